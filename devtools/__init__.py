"""merger's workshop: benchmarks, the bad-input catalogue, the browser driver, the code and
precision reports. Run from a checkout (``python -m devtools``); not installed with the package."""
