"""External policies for ERILS: sources, the cross-tokenizer bridge, length control and the mixer."""
