"""Many requests at once: torch-free scheduling bookkeeping, the batched cache and step, and
the batcher thread that drives requests through the same plan, prefill and decode."""
