"""Start the merge explorer from a checkout: ``python app.py [--pool demo|POOL.yaml] [--port 7860]``
(installed, the same is ``merger-app``; the flags are in merger/serve.py)."""
import sys

from merger.serve import main

if __name__ == "__main__":
    sys.exit(main(prog="app.py"))
