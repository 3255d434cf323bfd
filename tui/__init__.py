"""The Textual dashboard (`devbox tui`). It talks to devbox only: the app's workers reach
boxes through a `tui.feed.Feed`; screens and widgets do no I/O."""
