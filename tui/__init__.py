"""The Textual dashboard (`devbox tui`); built in step 4. It talks to devbox only."""
