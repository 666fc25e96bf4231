from streamchat.cli import main
import sys
sys.exit(main())
