"""One-off research probes: experiments whose findings shaped the product, kept runnable from the repository
root (`python -m research.NAME --help`). Not part of the installed package; research/README.md says what
each one taught and where its numbers are."""
