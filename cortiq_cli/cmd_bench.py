"""placeholder"""
def bench() -> None:
    """Chat."""
