"""`python -m maze --list | --freeze`: list or rewrite the frozen eval suites."""

from maze.core import main

main()
