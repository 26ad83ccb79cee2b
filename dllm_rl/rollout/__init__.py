"""Rollouts: the dLLM's denoising sampler and autoregressive sampling for the external policy."""
