"""The models' shared pieces: the native decoder every target family subclasses, the layers
and rotary embeddings drafters and targets share, the target interface (seam 2) and the
serving transforms."""
