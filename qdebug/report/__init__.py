"""Rendering of result tables: rich tables for terminals, JSON/CSV for machines."""
