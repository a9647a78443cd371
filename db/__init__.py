"""Storage: schema, migrations, engine setup and the store that holds every SQL statement.

This package is the ground floor: it imports nothing of ours.
"""
