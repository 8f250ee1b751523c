"""Building blocks of the native targets the runner owns: the shared decoder every target family
subclasses (`decoder`) and the serving transforms applied from outside (`transforms`). The
families themselves live in `draftinfer/families/`, loading in `draftinfer.loading`, the
plain decode baseline in `draftinfer.baseline`."""
