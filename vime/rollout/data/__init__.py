"""Prompt data: files into rows, rows into prompt tokens, the data source that hands out groups."""
