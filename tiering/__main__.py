import sys

from tiering.commands.main import main

if __name__ == "__main__":
    sys.exit(main())
