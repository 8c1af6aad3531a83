"""Model sources for kvmesh (the embedded default model, ...)."""
