"""Printed reports of measured numbers on a pool: ``merger report`` and ``merger demo report``."""
