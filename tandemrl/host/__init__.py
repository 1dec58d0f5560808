"""What every layer needs from the machine and its libraries (docs/DESIGN.md, "Where things live")."""
