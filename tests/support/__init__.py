"""What the tests share: fixture copies, real-format writers, stand-ins for tools not on PyPI."""
