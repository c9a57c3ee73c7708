"""`python -m maze --list | --freeze`: list or rewrite the frozen eval suites."""

from maze.evalsets import main

main()
