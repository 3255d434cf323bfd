"""Widgets and the pure text helpers they share. No I/O here: data arrives by assignment."""
