"""`python -m maze --list | --freeze`: list or rewrite the frozen eval suites."""

from maze.suites import main

main()
