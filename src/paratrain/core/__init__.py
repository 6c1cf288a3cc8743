"""What every layer uses, and nothing of paratrain's below it: the errors a user sees in one line
(`errors`), the optional dependencies (`optional`), import paths of the user's code (`import_path`), the
user's own line in a traceback (`tracebacks`), and output folders checked before any work and files written
whole or not at all (`outputs`). No torch."""
