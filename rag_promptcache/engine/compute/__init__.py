"""The forward passes: the one place a forward is chosen (runner.py), the lean Llama forward,
its fused CPU attention kernel and the native decode step."""
