from merger.cli import run

run()
