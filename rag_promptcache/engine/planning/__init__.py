"""From compiled pieces to a plan and its prefill: hits and misses in the store, encoding
modules, recovery and its token selection, the cost model that may choose full prefill, and
the prefill itself (whole or chunked)."""
