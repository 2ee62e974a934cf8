"""The user commands behind `kdflow COMMAND` (kdflow.cli parses the arguments and calls into these)."""
