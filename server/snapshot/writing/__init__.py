"""Writing a rank's snapshot: the writer, its sink and files, the copy-ahead and the I/O cap."""
