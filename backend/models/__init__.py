"""Model families, written against loom.layers; one file per family."""
