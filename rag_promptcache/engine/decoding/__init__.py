"""Decoding: the one DecodeState shared by the single-request loop and the batcher, sampling,
streamed text, prompt lookup and constrained decoding."""
