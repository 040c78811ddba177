"""Running the user's script in a supervised child, profiled or planned; the verify and re-profile rounds.
Imports every stage below it; parses no command line (docs/architecture.md).
"""
