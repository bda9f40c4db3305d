"""Sampling: penalties and logit_bias, greedy and random draws (the pure-Paddle draw is the reference), logprobs."""
