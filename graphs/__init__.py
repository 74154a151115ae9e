"""Model definitions written once against the ATB-named op set, plus the op set itself."""
