"""Memory planning: buffers from liveness, placed at byte offsets of one arena."""
