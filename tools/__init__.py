"""Repository-only tools: building and preparing the bundled corpora (not part of the installed package)."""
