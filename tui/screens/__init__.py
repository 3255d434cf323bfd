"""The dashboard's screens: boxes, one box, and the modal dialogs."""
