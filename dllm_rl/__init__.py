"""dllm-rl: reinforcement-learning post-training of masked-diffusion language models."""

__version__ = "0.1.0"
