"""The model seen as a masked-diffusion policy: native model, adapters for LLaDA and Dream, masking schedule."""
