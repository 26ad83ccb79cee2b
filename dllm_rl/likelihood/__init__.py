"""Likelihood estimators for masked-diffusion policies (see `estimators.py`)."""
