"""The mmap CPU engine: numbers in, numbers out."""
