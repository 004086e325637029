"""The tools: each computes one answer of a precision debug and returns DataFrames."""
