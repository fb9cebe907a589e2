"""Test and demo doubles, named as such: never part of a production path."""
