"""A model kept as a package, as projects keep theirs: its attention imports its config and helpers relatively."""
