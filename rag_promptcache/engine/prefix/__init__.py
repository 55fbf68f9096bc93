"""The prefix cache: KV that earlier requests ended with, in a radix tree over tokens, reused
exactly (bookkeeping in prefix_tree.py has no torch)."""
