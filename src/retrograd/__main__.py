import sys
from retrograd.cli.main import main
sys.exit(main())
