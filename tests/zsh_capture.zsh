#!/usr/bin/env zsh
# What zsh offers for a command line: usage: zsh_capture.zsh FPATH_DIR LINE (one candidate a line).
# An interactive zsh in a pseudo-terminal (zpty) presses Tab; compadd is wrapped to print what it adds. After
# zsh-capture-completion by Valodim (MIT), reduced to the candidates.
zmodload zsh/zpty || exit 2
zpty z zsh -f -i
local line
setopt rcquotes
() {
  zpty -w z source $1
  repeat 4; do
    zpty -r z line
    [[ $line == ok* ]] && return
  done
  echo 'error initializing.' >&2
  exit 2
} =( <<< '
PROMPT=
fpath=('$1' $fpath)
autoload -U compinit
compinit -u -d '$1'/.zcompdump
bindkey ''^M'' undefined
bindkey ''^J'' undefined
bindkey ''^I'' complete-word
null-line () { echo -E - $''\0'' }
compprefuncs=( null-line )
comppostfuncs=( null-line exit )
zstyle '':completion:*'' list-grouped false
zstyle '':completion:*'' insert-tab false
zstyle '':completion:*'' list-separator ''''
zmodload zsh/zutil
compadd () {
  if [[ ${@[1,(i)(-|--)]} == *-(O|A|D)\ * ]]; then
    builtin compadd "$@"
    return $?
  fi
  typeset -a __hits
  builtin compadd -A __hits "$@"
  [[ -n $__hits ]] || return
  for i in {1..$#__hits}; do
    echo -E - $__hits[$i]
  done
}
echo ok')
zpty -w z "$2"$'\t'
integer tog=0
while zpty -r z; do :; done | while IFS= read -r line; do
  if [[ $line == *$'\0\r' ]]; then
    (( tog++ )) && return 0 || continue
  fi
  (( tog )) && echo -E - ${line%$'\r'}
done
return 2
