import sys

try:  # a Ctrl-C before main() has installed its handler (mtjax.cli) ends the same way
    from mtjax.cli import main
except KeyboardInterrupt:
    sys.stderr.write("mtjax: interrupted\n")
    sys.exit(130)

sys.exit(main())
