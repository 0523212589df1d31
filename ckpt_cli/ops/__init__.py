"""Operations behind the commands: inspect, verify, convert (and its layouts), demo."""
