"""The KV a request runs on: reserved cache buffers and the assembly of relocated module KV into them."""
