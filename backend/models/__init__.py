"""Model families, written against backend.layers; one file per family."""
