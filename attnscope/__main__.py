"""`python -m attnscope`."""

from attnscope.cli import run

if __name__ == "__main__":
    run()
