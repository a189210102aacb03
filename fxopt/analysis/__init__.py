"""Read-only analyses shared by passes and codegen."""
