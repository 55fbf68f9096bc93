"""The project's own benchmark harnesses, run from the repository root as `python -m benchmarks.NAME`
(benchmarks/README.md says what each measures). Not part of the installed package: nothing in
`rag_promptcache` imports this folder (tests/test_layout.py)."""
