"""A child that would run for a long time: the supervisor must stop it."""

import time

if __name__ == "__main__":
    time.sleep(600)
