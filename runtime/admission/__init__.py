"""Admission: fleet-wide flow control of model calls and concurrency keys."""
