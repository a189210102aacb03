"""One module per pass; each pass is a frozen dataclass with a `name`, called as pass(gm, ctx)."""
